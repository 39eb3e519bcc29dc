# SHIM: the Neuron PyTorch plugin is not installable here; see README.md.
