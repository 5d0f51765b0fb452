"""GGUF file -> Hugging Face model directory (float32 weights, tokenizer, chat template).

    bon-gguf-convert --gguf FILE.gguf --output DIR    (or python -m jobs.gguf_convert ...)

transformers reads GGUF files (``from_pretrained(dir, gguf_file=name)``, with the ``gguf``
package installed) and de-quantizes the tensors into a float32 model. Such a model remembers its
GGUF origin in a quantization config (``config.quantization_config`` and ``model.hf_quantizer``),
which would make ``save_pretrained`` refuse or write a directory that asks for the GGUF file again;
both are dropped first, so the saved directory is a plain HF model that any of this repo's
engines loads (``HFEngine.from_pretrained``, ``AutoModelForCausalLM``). The tokenizer comes from
the GGUF metadata (``tokenizer.ggml.*`` keys, its chat template included); the generation config
keeps the GGUF's EOS/BOS/pad ids. ``jobs.fetch_models`` uses this on SmolLM2-135M-Instruct, and
tests/test_fetch_models.py on a tiny GGUF it writes itself.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from jobs.cli import exits_on_interrupt, job_parser, setup_logging

log = logging.getLogger(__name__)


def require_gguf() -> None:
    """ImportError, one line naming the extra, where the ``gguf`` package (which transformers reads
    GGUF files with) is not installed."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a GGUF file needs the gguf package: pip install 'bon-pipeline[gguf]'")


def convert_gguf(gguf_path: str | Path, output: str | Path, dtype: str = "float32") -> Path:
    """Convert one GGUF file into an HF directory at ``output`` (written to a temp dir, then renamed,
    so a half-written directory never looks complete). Returns ``output``."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, output = Path(gguf_path), Path(output)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    require_gguf()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    _drop_gguf_quantization(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "source.json").write_text(json.dumps({"gguf": name, "dtype": dtype,
                                                 "parameters": sum(p.numel() for p in model.parameters())}))
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    return output


def _drop_gguf_quantization(model) -> None:
    """The de-quantized weights are plain tensors: forget the GGUF quantizer and its config."""
    model.hf_quantizer = None
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:  # a read-only property in some versions
            pass


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    parser = job_parser("bon-gguf-convert", __doc__)
    parser.add_argument("--gguf", required=True, help="the .gguf file")
    parser.add_argument("--output", required=True, help="HF directory to write")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        out = convert_gguf(args.gguf, args.output)
    except (FileNotFoundError, ImportError) as exc:
        log.error("%s", exc)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
