"""Each kind's serving formats as codecs (drafttrain.drafts.codecs), one module per kind."""
