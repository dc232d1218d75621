"""Offline training tools: the self-distillation job shared by heads and twins (``distil``,
``distil_prompts``, ``distil_snippets``), EAGLE draft heads (``eagle_train``, ``eagle_data``,
``eagle_losses``, ``eagle_prompts``) and diffusion twins (``diffusion_train``, ``diffusion_twin``,
``diffusion_data``, ``diffusion_eval``). The serving path never imports this package."""
