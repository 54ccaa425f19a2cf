"""Models as the ranks and the driver load them: Hugging Face classes with LoRA, the attention kernel and
precision this machine can run, LoRA targets checked against the architecture, the toy's evaluation. Imports
data, storage and the shared modules, never a rank's or the driver's code."""
