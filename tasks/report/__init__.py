"""What a user reads and looks at: figures (overlay grids and bench quality's report), overlay
(label maps coloured over their images, with a key), status (``wsseg status``, from the store
alone)."""
