"""fedprivacy: federated, proactive DP-SGD. See README.md and ../shared/DESIGN.md."""

__version__ = "0.1.0"
