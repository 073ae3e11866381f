"""Files on disk: checkpoint folders, model folders and `tinker://` paths, RNG states, archives."""
