"""Train a Fractus CTE or the Transformer++ on prepared tokens: ``python -m fractus.train --help``.

The command line of the training core (:mod:`fractus.training.loop`, where its options are
described); nothing imports this module.
"""
from fractus.training.loop import main

if __name__ == "__main__":
    main()
