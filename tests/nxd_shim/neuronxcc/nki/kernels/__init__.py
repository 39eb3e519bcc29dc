# SHIM: Neuron's NKI kernel package; see README.md ("The Trainium-stack test environment").
