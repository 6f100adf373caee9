"""The cluster estimate: ``Cluster`` (GPU kinds, links, presets) and ``estimate`` (step time, MFU and
memory per GPU of a plan on a cluster), with the published runs it is checked against."""
