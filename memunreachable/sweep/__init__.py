"""sweep: stages 3 and 5-7, run in the forked sweeper: classify the mappings, mark from the
roots, fold what stays unmarked.

sweeper (the forked process and its pipe), classify (mapping -> heap | root | stack | skip),
detect (which allocator), mark, folding, written (pages written since a point), explain
(why a block was kept).
"""
