"""Files on disk: checkpoint folders, run folders and `tinker://` paths, RNG states, archives."""
