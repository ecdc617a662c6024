"""BFCL v4 multi-turn environment (see `bfcl.py`)."""
