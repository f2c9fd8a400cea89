"""Train a Fractus CTE or the Transformer++ on prepared tokens: ``python -m fractus.train --help``.

The command line of the training core (:mod:`fractus.training.command`; its options are
:mod:`fractus.training.options`'); nothing imports this module.
"""
from fractus.training.command import main

if __name__ == "__main__":
    main()
