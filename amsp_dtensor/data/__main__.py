import sys

from . import DEFAULT_ROOT, ensure_assets

if __name__ == "__main__":
    assets = ensure_assets(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_ROOT)
    print(f"corpus: {assets.corpus_dir}\ntokenizer: {assets.tokenizer_dir}")
