"""The pieces a local engine is built from: the base model and its adapters, and what trains them."""
