"""The restore path: finding checkpoints, and reading their chunks back into live training state on any world size."""
