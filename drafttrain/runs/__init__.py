"""What a recipe does end to end, as library calls the commands (and users' own scripts) make:
``drafttrain.runs.train.train(recipe)``."""
