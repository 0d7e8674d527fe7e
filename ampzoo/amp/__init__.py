"""ampzoo.amp: mixed precision you can see into, the library.

policy.py (which Cells run in which dtype), names.py (the Cell registry behind keep_fp32/force_fp16),
loss_scale.py (the loss-scaled train step, on every device), telemetry.py (overflow and scale logging),
fallback.py (the ladder), functional.py (a jit-compiled step for hand-written loops). The commands
`python -m amp.report | amp.audit | amp.search` live in the top-level amp/ package: they use the engine, which
uses this library, so nothing in the library imports them.
"""
