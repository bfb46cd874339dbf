"""The Flower ClientApp of fedprivacy (glue; the client's logic is fedprivacy.participant)."""
