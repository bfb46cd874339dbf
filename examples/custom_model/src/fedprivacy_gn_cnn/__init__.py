"""A GroupNorm CNN that fedprivacy finds by its entry point, gn-cnn."""
