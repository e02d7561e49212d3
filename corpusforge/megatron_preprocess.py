"""`python -m corpusforge.megatron_preprocess ARGS`: a drop-in for `python tools/preprocess_data.py ARGS`.

Example:
    python -m corpusforge.megatron_preprocess --input c.jsonl --output-prefix out/c \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8
"""

from corpusforge.cli.megatron_preprocess import main

if __name__ == "__main__":
    main()
