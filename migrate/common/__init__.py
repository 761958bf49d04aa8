"""What both twins share: logical axis names, the mesh and the one resolver, dtypes and
initializers, the optimizer, the GPipe schedule, layer placement, weight layouts, MoE routing."""
