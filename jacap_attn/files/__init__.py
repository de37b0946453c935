"""Files: the saved cache format, 8-bit entries, save and load, paths written atomically (docs/cache.md#saved-file-format)."""
