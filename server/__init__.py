"""The Flower ServerApp of fedprivacy and its strategy (glue around fedprivacy.results)."""
