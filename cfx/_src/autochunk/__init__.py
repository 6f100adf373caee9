"""AutoChunk: trace a function's aten graph, estimate its peak memory op by op, and chunk the regions that fit a budget (see ``cfx.autochunk``)."""
