"""SHIM: NKI flash-attention kernels; see README.md.  optimum-neuron's training modeling imports ``FlashConfig``
at module level for its flash-attention path; nothing in checkpoint loading or consolidation calls it."""


class FlashConfig:
    """Stand-in holding the keyword arguments it was given (never handed to a kernel here)."""

    def __init__(self, **kwargs: object) -> None:
        self.__dict__.update(kwargs)
