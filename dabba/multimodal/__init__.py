"""Images in: opening what strangers send (media.py) and turning an image into the pixel values
a vision tower reads, as each checkpoint's preprocessor_config.json says (image_processor.py)."""
