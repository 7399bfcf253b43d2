"""Rebuild `snippets_sample.jsonl`: Python standard-library module docstrings as documents,
with queries written for them by hand (see README.md here for the license).

    python jobs/data/make_snippets_sample.py   # writes jobs/data/snippets_sample.jsonl

Each document is the module's docstring up to about 1,800 characters, cut at a paragraph
break. Docstrings change a little between Python versions; the bundled file was made with
CPython 3.11.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

MAX_CHARS = 1800

QUERIES: dict[str, list[str]] = {
    "csv": [
        "why not split CSV lines on commas",
        "what is a CSV dialect",
        "default quote character",
        "what does skipinitialspace do",
    ],
    "argparse": [
        "sum integers from the command line example",
        "which exception does ArgumentParser raise for bad actions",
        "what is FileType for",
    ],
    "heapq": [
        "is heap[0] the smallest item",
        "how to turn a list into a heap in linear time",
        "difference between heappushpop and heapreplace",
        "does heappop return the largest item",
    ],
    "itertools": [
        "iterator that repeats an element endlessly",
        "how to get overlapping pairs of consecutive elements",
        "cartesian product of iterables",
    ],
    "collections": [
        "list-like container with fast appends on both ends",
        "dict subclass for counting hashable objects",
        "dict that supplies missing values from a factory",
    ],
    "tempfile": [
        "which function has race conditions",
        "what does tempdir control",
        "are names returned as bytes or str",
    ],
    "unittest": [
        "what frameworks inspired unittest",
        "how should test method names begin",
        "which class runs tests and reports results as text",
    ],
    "doctest": [
        "how to run the examples in a module's docstrings",
        "how to get a verbose report",
        "what is printed when an example fails",
    ],
    "copy": [
        "difference between shallow and deep copy",
        "problems with deep copy operations",
        "which types are not copied",
        "methods a class can define to control copying",
    ],
    "string": [
        "constant with all ASCII punctuation characters",
        "string of hexadecimal digits",
        "ASCII letters upper and lower case",
    ],
    "difflib": [
        "find close matches to a word",
        "unified diff of two lists of strings",
        "HTML side by side comparison",
    ],
    "random": [
        "period of the Mersenne Twister",
        "is random() thread safe",
        "which distributions work on angles",
    ],
    "sqlite3": [
        "how to open an in-memory database",
        "minimum SQLite version required",
        "how to run a query and iterate over rows",
    ],
    "socket": [
        "map a hostname to an IP number",
        "convert 16 bit ints from network to host byte order",
        "which socket types are supported on Unix",
    ],
    "subprocess": [
        "run a command and wait for it to finish",
        "what does check_call raise on a nonzero return code",
        "redirect stderr into stdout",
        "get a command's output and exit code from the shell",
    ],
    "typing": [
        "which PEP defines gradual typing",
        "what are generic aliases",
        "protocols for duck typing",
    ],
    "inspect": [
        "how to get the source code of an object",
        "get a Signature object for a callable",
        "check whether an object is a generator function",
    ],
    "ast": [
        "how to generate an abstract syntax tree",
        "can a modified tree be compiled",
        "who is the copyright holder of ast",
    ],
    "timeit": [
        "default number of repeats",
        "how the number of loops is chosen",
        "is the setup statement timed",
        "use process time instead of perf_counter",
    ],
    "pprint": [
        "pretty-print a dictionary to a stream",
        "repr that is safe for recursive data structures",
        "format an object as a pretty string",
    ],
    "hashlib": [
        "where are adler32 and crc32",
        "which hashes are slow on 32 bit platforms",
        "what does hexdigest return",
        "reuse a hash object for inputs with a common prefix",
    ],
    "uuid": [
        "which uuid function may compromise privacy",
        "make a random UUID",
        "UUID from a namespace and a name with SHA-1",
    ],
    "urllib.parse": [
        "which RFC is the current URL standard",
        "is urlparse compliant with WHATWG",
        "RFC for literal IPv6 addresses in URLs",
    ],
    "mimetypes": [
        "guess the MIME type of a URL",
        "guess the file extension for a MIME type",
        "where are default MIME values on Windows",
    ],
    "fnmatch": [
        "case sensitive filename matching",
        "turn a shell pattern into a regular expression",
        "are compiled patterns cached",
    ],
    "getopt": [
        "allow options and arguments to be intermixed",
        "exception raised for a bad option",
        "are long options supported",
    ],
    "sched": [
        "is the scheduler thread safe",
        "do lower priority numbers run first",
        "what does an event tuple contain",
    ],
    "struct": [
        "format character for big-endian",
        "format code for unsigned short",
        "is whitespace allowed in format strings",
        "which format chars are native only",
    ],
    "io": [
        "which module defines the builtin open",
        "in-memory text stream",
        "class for buffered random access",
    ],
    "shelve": [
        "what values can a shelf store",
        "does d[key] return a copy",
        "why does appending to d[key] not change the shelf",
    ],
}


def document(module: str) -> str:
    """The module's docstring, up to MAX_CHARS characters, cut at a paragraph break."""
    doc = inspect.cleandoc(importlib.import_module(module).__doc__ or "")
    out: list[str] = []
    size = 0
    for para in doc.split("\n\n"):
        if out and size + len(para) > MAX_CHARS:
            break
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out).strip()


def main() -> None:
    """Write the sample next to this script."""
    path = Path(__file__).with_name("snippets_sample.jsonl")
    with path.open("w", encoding="utf-8") as fh:
        for module, queries in QUERIES.items():
            text = document(module)
            for q, query in enumerate(queries):
                row = {"id": f"{module}-{q}", "doc_id": module, "document": text, "query": query}
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
