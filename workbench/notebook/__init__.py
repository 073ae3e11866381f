"""The notebook surface: `Session`, the background run loop, the panel, plots, token views and probes."""
