"""The save path: turning live training state into stored chunks on every rank, synchronously or in the background."""
