"""``spotdrain simulate``: a whole Spot interruption on one machine, on the embedded fakes and the real programs.

The fake IMDS and Kubernetes API, a fake engine and a real ``spotdrain sidecar`` per pod, a real ``spotdrain node``, a
router that keeps only ready pods in rotation, a load generator, and the simulation itself playing the kubelet. The run
is printed as a timeline and judged against what its scenario expects.
"""
