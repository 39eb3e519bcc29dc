# SHIM: NxD's parallel_state.initialize_model_parallel asks the Neuron runtime which chip it runs on; the shim answers
# from NXD_SHIM_PLATFORM ("trn1" or "trn2"), which is how the fixtures pick NxD's trn1 or trn2 KV layout.
import os


def get_platform_target() -> str:
    return os.environ.get("NXD_SHIM_PLATFORM", "trn1")
