"""Graph passes: one module per pass, registered by name (``fuse_gelu.py`` <-> ``fuse-gelu``)."""
