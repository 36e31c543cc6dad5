"""Write the served model's tokenizer as a Hugging Face tokenizer directory, for tools that count
tokens with `transformers` offline (AIPerf's --tokenizer): tokenizer.json plus a
tokenizer_config.json naming the BOS/EOS tokens and the chat template.

    python benchmarks/export_tokenizer.py OUT_DIR [--model GGUF_OR_HF_DIR]
"""
import argparse
import json
from pathlib import Path

from replica.executor.checkpoint import load_checkpoint


def export(model: str | None, out_dir: Path) -> None:
    tokenizer = load_checkpoint(model).tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tokenizer.chat_template,
              "bos_token": _token(tokenizer, tokenizer.bos_token_id),
              "eos_token": _token(tokenizer, tokenizer.eos_token_id)}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _token(tokenizer, token_id: int | None) -> str | None:
    return tokenizer.backend.id_to_token(token_id) if token_id is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", help="GGUF file or Hugging Face model directory (default: the served default)")
    args = parser.parse_args()
    export(args.model, args.out_dir)


if __name__ == "__main__":
    main()
