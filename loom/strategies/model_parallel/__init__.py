"""Strategies that split the model itself: sharded (FSDP2), tensor, pipeline and their hybrid on a
device mesh. Nothing is imported here: DTensor and FSDP2 cost a second of CPU to import, paid
only by the processes that use them."""
