#!/usr/bin/env python3
"""Write the training prompt set for Medusa self-distillation (JSONL, one {"prompt": ...} a line).

Templates crossed with subject lists, written for this recipe: no benchmark prompt is reused.
    python make_prompts.py OUT.jsonl [--n 600] [--seed 0]
"""
import argparse
import json
import random

SUBJECTS = [
    "the ocean", "a lighthouse keeper", "volcanoes", "the moon landing", "honeybees", "a busy train station",
    "artificial intelligence", "the water cycle", "ancient Rome", "a small bakery", "climate change", "chess",
    "the human heart", "photosynthesis", "a rainy afternoon", "electric cars", "the printing press", "friendship",
    "mountain climbing", "coffee", "black holes", "the internet", "a lost cat", "recycling", "the Renaissance",
    "jazz music", "vaccines", "a desert oasis", "public libraries", "solar panels", "the stock market",
    "dinosaurs", "a job interview", "gardening", "earthquakes", "the Olympic Games", "bread baking", "winter",
    "the French Revolution", "DNA", "social media", "a robot learning to paint", "rivers", "sleep", "democracy",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "merges two sorted lists", "counts word frequencies in a text",
    "computes the factorial of n", "finds the largest element in a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "checks whether a string is a palindrome", "flattens a nested list",
    "computes the greatest common divisor of two numbers", "reads a CSV file and returns the rows as dictionaries",
    "implements binary search", "returns the n-th Fibonacci number", "validates an email address with a regular expression",
    "sorts a list of dictionaries by a key", "computes the average of a list of numbers", "transposes a matrix",
    "implements a stack class with push and pop", "counts the vowels in a string", "finds all anagrams of a word in a list",
    "implements bubble sort", "parses a date string and returns the weekday", "computes the dot product of two vectors",
]
LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]
TEMPLATES = [
    "Write a short story about {s}.", "Write a poem about {s}.", "Explain {s} to a ten-year-old.",
    "What are the main advantages and disadvantages of {s}?", "Give me five interesting facts about {s}.",
    "Write a blog post introduction about {s}.", "Describe {s} in three paragraphs.",
    "Write a persuasive paragraph about why people should learn more about {s}.",
    "Pretend you are a tour guide and talk about {s}.", "Write a dialogue between two friends discussing {s}.",
    "Summarize the history of {s}.", "What questions would a student ask about {s}? Answer them.",
    "Write a product description inspired by {s}.", "List the key concepts someone needs to understand {s}.",
    "Compare {s} and {t}.", "Write a haiku and then a limerick about {s}.",
    "Translate this sentence into French and German: 'I would like to learn more about {s}.'",
    "Write an email to a colleague about a project on {s}.",
]
MATH = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost? Explain step by step.",
    "What is {a} multiplied by {b}? Show your work.", "Solve for x: {a}x + {b} = {c}.",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "If a rectangle has sides {a} and {b}, what are its area and perimeter?",
    "Tom has {a} apples and gives away {b}. Then he buys {c} more. How many apples does he have?",
    "What is {a}% of {c}?", "Is {c} a prime number? Explain.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    pool = []
    for _ in range(a.n * 3):
        kind = rng.random()
        if kind < 0.6:
            s, t = rng.sample(SUBJECTS, 2)
            pool.append(rng.choice(TEMPLATES).format(s=s, t=t))
        elif kind < 0.85:
            pool.append(f"Write a {rng.choice(LANGS)} function that {rng.choice(CODE_TASKS)}.")
        else:
            x, y, z = rng.randint(2, 99), rng.randint(2, 30), rng.randint(100, 999)
            pool.append(rng.choice(MATH).format(a=x, b=y, c=z))
    prompts = list(dict.fromkeys(pool))[: a.n]
    with open(a.out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"wrote {len(prompts)} prompts to {a.out}")


if __name__ == "__main__":
    main()
