"""Storage: a compressed layer's layouts, the cache over them and the model it belongs to (docs/cache.md)."""
