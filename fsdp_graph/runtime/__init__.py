"""The sharding runtime: flat-parameter layout and state, the class swap that exposes parameters, gradients,
initialisation, CPU offload, process groups and devices."""
