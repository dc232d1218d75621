"""The compile machinery: compiled step graphs (AOTInductor packages on the CPU, ``torch.compile``
and captured CUDA graphs elsewhere), the background thread that builds them, and the CUDA-shaped
profile that runs the CUDA path's choices on the CPU. The engine runs eagerly without any of it."""
