"""ZeRO (stages 0-3) as an optimizer transform and a layer transform, with Gemini placement.

``flat``: shard layouts; ``params``: ZeRO-3's stored params; ``optimizer``: the transformation;
``buckets``: stage-2 reduce-scatter during backward; ``gathered``: the stage-3 layer transform;
``offload``: Gemini chunk placement and the host/NVMe optimizer step; ``api``: ``cfx.zero``.
"""
