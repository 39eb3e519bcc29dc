# SHIM: the Neuron compiler package; see README.md.
