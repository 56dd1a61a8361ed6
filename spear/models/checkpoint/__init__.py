"""spear checkpoints: a folder that any spear command and the Python API load.

The format and its schema check (``format.py``), the writer (``save.py``) and the loader
(``load.py``).

Layout::

    config.json, generation_config.json, tokenizer files   (from the source model)
    spear_config.json   format version, quantization config, every quantized module
                        (shape, bits, group size, compensator kind and spec), any
                        calibration / plan metadata the writer adds under "meta", and
                        "files": the names of the checkpoint's files, which --overwrite
                        replaces (a folder holding anything else is refused, not deleted)
    plan.json           spear calibrate's selection (written after the rest)
    model.safetensors   <module>.qweight  uint8 (out, ceil(in*bits/8)) packed codes
                        <module>.scales   fp16 (out, n_groups)
                        <module>.zeros    uint8 (out, n_groups)      (asymmetric only)
                        <module>.bias     (when the linear has one)
                        <module>.compensator.<tensor>   fp16
                        every other model tensor (embeddings, norms...) as is

Loading builds the architecture from config.json with empty weights, swaps in
quantized shells, and validates spear_config.json's schema and every tensor's name,
shape, dtype, finiteness and code range before assigning it; nothing is ever
unpickled, and a damaged file is a SpearError naming it, never a traceback or random
weights. spear_config.json records each tensor's SHA-256; ``verify=True``
(``--verify``) checks them, which also catches bit flips that leave values finite.
Writes go to a temporary sibling folder that is renamed into place, so a failed
write leaves nothing half-written; the temporary folders of a killed writer are
removed by the next write to the same place (spear/fileio.py).
"""

from spear.models.checkpoint.format import (CONFIG_NAME, DTYPES, FORMAT, GENERATION_CONFIG_NAME, VERSION,
                                            WEIGHTS_NAME, checkpoint_files, is_checkpoint, non_persistent_buffers,
                                            quantization_config, read_spear_config, tensor_sha256)
from spear.models.checkpoint.load import (check_folder_configs, load_checkpoint, load_folder_tokenizer,
                                          read_generation_config, read_hf_config, read_tensors)
from spear.models.checkpoint.save import check_checkpoint_out, save_checkpoint

__all__ = ["CONFIG_NAME", "DTYPES", "FORMAT", "GENERATION_CONFIG_NAME", "VERSION", "WEIGHTS_NAME", "check_checkpoint_out",
           "check_folder_configs", "checkpoint_files", "is_checkpoint", "load_checkpoint", "load_folder_tokenizer", "non_persistent_buffers",
           "quantization_config", "read_generation_config", "read_hf_config", "read_spear_config", "read_tensors",
           "save_checkpoint", "tensor_sha256"]
