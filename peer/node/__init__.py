"""Node layer: a volunteer's peer (join, measure, claim, serve, leave) and its config."""
