# SHIM: the NKI language module (imported by optimum-neuron's kernels at module level); see README.md.
