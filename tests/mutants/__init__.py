"""The mutation benchmark's planted bugs (``plants.py``) and its catalogue (``catalogue.py``);
``benchmarks/mutation.py`` runs them, ``site/sitecustomize.py`` plants one in every process."""
