"""What the ZeRO math predicts, as pure arithmetic on counts and sizes (no torch, accelerate or DeepSpeed is
loaded): bytes per GPU of each engine's model states, activations, transient buffers and DeepSpeed's buckets
(model_states), and the peak's terms that grow with real shapes (peak_terms). The estimate
(zero_utils.memory.estimate) and each run's report (zero_utils.train.measurement) both read them."""
