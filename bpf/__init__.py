"""BPF C sources, shipped as package data and loaded through importlib.resources."""
