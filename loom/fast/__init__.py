"""CPU speed-ups a strategy can apply to a model (``prepare(fast_path=...)``): exact ones such as
the allocator settings, and opt-in ones such as ``channels_last`` and the pooling kernel."""
