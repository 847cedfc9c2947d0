"""mia's files on disk: written atomically, hashed once, and kept under the cache's size limit.

``atomic``       atomic writes (a temporary sibling, then ``os.replace``): text, JSON, bytes, ``.npz``, figures.
``hashing``      SHA-256 of files and paths, memoised by (path, size, mtime, ctime); the cache directory.
``cache_limit``  the size limit of mia's on-disk caches and the eviction of the least recently used entries.
"""
