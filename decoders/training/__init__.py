"""Offline training tools: EAGLE draft heads (``eagle_train``, ``eagle_losses``, ``eagle_prompts``)
and diffusion twins (``diffusion_train``, ``diffusion_twin``, ``diffusion_data``,
``diffusion_eval``). The serving path never imports this package."""
