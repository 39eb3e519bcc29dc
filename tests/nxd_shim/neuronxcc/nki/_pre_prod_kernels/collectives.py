# SHIM: NxD's parallel_state imports CollectivesConfig from the Neuron compiler and, while initialising, reads
# ``rank_src_tgt_pairs[rank]`` from one built over the context-parallel replica groups (ring-attention send/receive
# pairs, used only by on-device collective kernels the CPU path never runs).  This stand-in keeps its arguments and
# gives each rank the ring pair (itself -> next rank of its group); with context parallelism 1 that is (r, r).


class CollectivesConfig:
    def __init__(self, replica_groups=(), **kwargs):
        self.replica_groups = replica_groups
        self.__dict__.update(kwargs)
        self.rank_src_tgt_pairs = {}
        for group in replica_groups:
            for i, r in enumerate(group):
                self.rank_src_tgt_pairs[r] = [(r, group[(i + 1) % len(group)])]
