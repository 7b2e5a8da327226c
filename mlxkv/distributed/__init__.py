"""One model across several Macs on `mx.distributed`: the cluster, the sharding rules,
the step-plan channel from rank 0 to the others, and the cluster-wide model identity."""
